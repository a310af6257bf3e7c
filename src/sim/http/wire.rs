//! Faults applied on the wire after Nova processed the request: a late
//! answer, a closed connection, a stalled or cut body, garbage, a Nova
//! fault or a proxy's page instead of the answer.

use std::time::Duration;

use axum::body::Body;
use axum::http::Response;

// A body replaced here is no longer the fault it was: never rendered
// again (translated) from the one it replaced.
use super::i18n::NovaFault;
use super::{abort, render};
use crate::sim::Fault;

/// Applies a fault that acts after processing (or instead of it).
pub(super) async fn after_effect(
    fault: Option<Fault>,
    ok: Response<Body>,
    mv: (u32, u32),
) -> Response<Body> {
    match fault {
        Some(Fault::DelayAfterEffect { ms }) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            ok
        }
        Some(Fault::LateStatus { ms, code }) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            render(
                crate::sim::fault(
                    code,
                    "Unexpected API Error. Please report this at http://bugs.launchpad.net/nova/ and attach the Nova API log if possible.".into(),
                ),
                mv,
            )
        }
        Some(Fault::CloseAfterEffect) => abort(),
        Some(Fault::StallBody { ms, .. }) => stalled(ok, Duration::from_millis(ms)).await,
        Some(Fault::TruncateBody { .. }) => truncated(ok).await,
        Some(Fault::GarbageBody) => Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from("<html><body>Service temporarily rewritten by a proxy</body></html>"))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        // Nova's fault, named as Nova names that status.
        Some(Fault::Status { code, .. }) => render(
            crate::sim::fault(
                code,
                "Unexpected API Error. Please report this at http://bugs.launchpad.net/nova/ and attach the Nova API log if possible.".into(),
            ),
            mv,
        ),
        Some(Fault::Page {
            code,
            content_type,
            body,
            ..
        }) => Response::builder()
            .status(code)
            .header("content-type", content_type)
            .body(Body::from(body))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        Some(Fault::HugeBody { bytes, announced }) => huge(ok, bytes, announced),
        Some(Fault::ProxyError { code, .. }) => Response::builder()
            .status(code)
            .header("content-type", "text/html")
            .body(Body::from(if code == 504 { "Gateway Timeout" } else { "Bad Gateway" }))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        _ => ok,
    }
}

/// `ok`'s status and headers with a body of `bytes` spaces (valid JSON
/// whitespace, so only its size is wrong): whole with its length, or
/// streamed in 64 KiB chunks without one.
fn huge(ok: Response<Body>, bytes: usize, announced: bool) -> Response<Body> {
    let (mut parts, _) = ok.into_parts();
    parts.headers.remove("content-length");
    parts.extensions.remove::<NovaFault>();
    if announced {
        return Response::from_parts(parts, Body::from(vec![b' '; bytes]));
    }
    const CHUNK: usize = 64 * 1024;
    let stream = futures_util::stream::unfold(bytes, |left| async move {
        (left > 0).then(|| {
            let n = left.min(CHUNK);
            (
                Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; n])),
                left - n,
            )
        })
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Sends the headers and half the body, stalls, then the rest.
async fn stalled(ok: Response<Body>, stall: Duration) -> Response<Body> {
    let (parts, body) = ok.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let bytes = if bytes.is_empty() {
        bytes::Bytes::from_static(b"{\"volumeAttachments\": []}")
    } else {
        bytes
    };
    let half = bytes.len() / 2;
    let (a, b) = (bytes.slice(..half), bytes.slice(half..));
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            match step {
                0 => Some((Ok::<_, std::io::Error>(a), 1)),
                1 => {
                    tokio::time::sleep(stall).await;
                    Some((Ok(b), 2))
                }
                _ => None,
            }
        }
    });
    let mut parts = parts;
    parts.headers.remove("content-length");
    parts.extensions.remove::<NovaFault>();
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Sends the headers and half the body, then fails the stream: the
/// connection is cut mid-body.
async fn truncated(ok: Response<Body>) -> Response<Body> {
    let (mut parts, body) = ok.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let bytes = if bytes.is_empty() {
        bytes::Bytes::from_static(b"{\"volumeAttachments\": []}")
    } else {
        bytes
    };
    let half = bytes.slice(..bytes.len() / 2);
    // The headers and the first half go out; then the connection is cut.
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let half = half.clone();
        async move {
            match step {
                0 => Some((Ok::<_, std::io::Error>(half), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((
                        Err(std::io::Error::other("simulated connection cut mid-body")),
                        2,
                    ))
                }
                _ => None,
            }
        }
    });
    parts.headers.remove("content-length");
    parts.extensions.remove::<NovaFault>();
    Response::from_parts(parts, Body::from_stream(stream))
}
