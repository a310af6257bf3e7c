//! The request size limit, a layer of the server chain (innermost of
//! ours): a gRPC message larger than `--max-message-bytes` is refused from
//! its 5-byte length prefix, before anything of it is buffered, with
//! `RESOURCE_EXHAUSTED` `MESSAGE_TOO_LARGE` naming the limit.

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower::{Layer, Service};

/// Refuses a request whose gRPC message is larger than the limit from its
/// 5-byte length prefix, before anything of it is buffered, with
/// `RESOURCE_EXHAUSTED` naming the limit (tonic itself would say
/// OUT_OF_RANGE after the fact).
#[derive(Clone)]
pub struct MessageLimitLayer {
    pub limit: usize,
}

impl<S> Layer<S> for MessageLimitLayer {
    type Service = MessageLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        MessageLimitService {
            inner,
            limit: self.limit,
        }
    }
}

#[derive(Clone)]
pub struct MessageLimitService<S> {
    inner: S,
    limit: usize,
}

impl<S> Service<http::Request<tonic::body::Body>> for MessageLimitService<S>
where
    S: Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let limit = self.limit;
        self.inner.call(req.map(|b| {
            tonic::body::Body::new(LimitedBody {
                inner: b,
                prefix: [0; 5],
                have: 0,
                limit,
            })
        }))
    }
}

struct LimitedBody {
    inner: tonic::body::Body,
    prefix: [u8; 5],
    have: usize,
    limit: usize,
}

fn too_large(len: usize, limit: usize) -> tonic::Status {
    let mut meta = HashMap::new();
    meta.insert("limit_bytes".to_string(), limit.to_string());
    meta.insert("message_bytes".to_string(), len.to_string());
    let details = tonic_types::ErrorDetails::with_error_info(
        "MESSAGE_TOO_LARGE",
        super::status::DOMAIN,
        meta,
    );
    <tonic::Status as tonic_types::StatusExt>::with_error_details(
        tonic::Code::ResourceExhausted,
        format!(
            "the request message of {len} bytes exceeds the limit of {limit} bytes (--max-message-bytes)"
        ),
        details,
    )
}

impl http_body::Body for LimitedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && this.have < 5
            && let Some(data) = frame.data_ref()
        {
            let take = (5 - this.have).min(data.len());
            this.prefix[this.have..this.have + take].copy_from_slice(&data[..take]);
            this.have += take;
            if this.have == 5 {
                let len = u32::from_be_bytes([
                    this.prefix[1],
                    this.prefix[2],
                    this.prefix[3],
                    this.prefix[4],
                ]) as usize;
                if len > this.limit {
                    return Poll::Ready(Some(Err(too_large(len, this.limit))));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
