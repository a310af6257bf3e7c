//! An answer given by a layer before the handler (a request shed) waits
//! for the request's body first, within bounds.
//!
//! Answered with its body unread, the stream is reset while the client is
//! still sending it, and the client's DATA frames that arrive after are
//! charged to the connection's budget of small frames (h2 0.4.16 and
//! later) without being read: a flooding caller shed some thousands of
//! times while the service was busy got its whole connection closed
//! (`GOAWAY ENHANCE_YOUR_CALM, too_many_data_frames`), and with it every
//! other call on it, its well-behaved ones too (tests/api/security.rs, the flooding caller). Read
//! (and dropped), the frames are refunded, and the answer ends the stream
//! cleanly. A unary request's body is already here or a moment away; a
//! client that sends more than [`DRAIN_BYTES`], or takes longer than
//! [`DRAIN_FOR`], gets the answer then (frames that large are not the
//! small ones the budget counts). The auth layer's refusals answer at
//! once: 32,000 of them over one busy connection did not close it (tried
//! with a test that was removed again: it could not fail).

use std::time::Duration;

use http_body_util::BodyExt as _;

use crate::domain::BoxFuture;

/// How much of a refused request's body is read before the answer.
pub const DRAIN_BYTES: usize = 64 * 1024;
/// How long a refused request's body is waited for before the answer.
pub const DRAIN_FOR: Duration = Duration::from_secs(1);

/// `answer`, once `req`'s body has ended (or the bounds above are hit).
pub fn after_body<B, R, E>(
    req: http::Request<B>,
    answer: http::Response<R>,
) -> BoxFuture<Result<http::Response<R>, E>>
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    R: Send + 'static,
    E: Send + 'static,
{
    let mut body = req.into_body();
    Box::pin(async move {
        let read = async {
            let mut read = 0usize;
            while read <= DRAIN_BYTES {
                match body.frame().await {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            read += bytes::Buf::remaining(data);
                        }
                    }
                    // The body ended, or the client reset its stream: either
                    // way nothing more of it comes.
                    Some(Err(_)) | None => break,
                }
            }
        };
        // Past the bound the answer goes anyway (see the module's doc).
        if tokio::time::timeout(DRAIN_FOR, read).await.is_err() {
            tracing::debug!(
                "a refused request's body took longer than {DRAIN_FOR:?}; answered before its end"
            );
        }
        Ok(answer)
    })
}
