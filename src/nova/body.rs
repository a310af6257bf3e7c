//! Reading a response body whole: chunk by chunk under the request's
//! deadline, refused once it passes a cap (or announces more), so memory
//! stays bounded whatever answers and the deadline still bounds the time.
//! Nova's and Cinder's answers (`http`) and Keystone's (`auth`) are read so.

use bytes::Bytes;
use tokio::time::Instant;

use super::error::error_chain;

/// Why a body was not read whole.
pub(super) enum BodyError {
    /// The deadline came first, after this many bytes.
    Deadline(usize),
    /// The stream failed after this many bytes.
    Lost(usize, String),
    /// Past `cap`: announced so (`Content-Length`), or read past it.
    TooLarge {
        cap: usize,
        announced: Option<u64>,
        read: usize,
    },
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Deadline(got) => write!(f, "body still incomplete after {got} bytes"),
            BodyError::Lost(got, cause) => write!(f, "body cut off after {got} bytes: {cause}"),
            BodyError::TooLarge {
                cap,
                announced: Some(len),
                ..
            } => write!(
                f,
                "the body is larger than the {} cap (Content-Length {len}); not read",
                human_bytes(*cap)
            ),
            BodyError::TooLarge { cap, read, .. } => write!(
                f,
                "the body is larger than the {} cap ({read} bytes read, and more came); the rest was not read",
                human_bytes(*cap)
            ),
        }
    }
}

/// `2 MiB`, `512 KiB` or `100 bytes`.
fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

/// Reads `resp`'s body chunk by chunk until `deadline`, refusing it once
/// it passes `cap` bytes (or announces more): memory stays bounded
/// whatever answers, and the deadline still bounds the time.
pub(super) async fn read_body(
    mut resp: reqwest::Response,
    deadline: Instant,
    cap: usize,
) -> Result<Bytes, BodyError> {
    if let Some(len) = resp.content_length()
        && len > cap as u64
    {
        return Err(BodyError::TooLarge {
            cap,
            announced: Some(len),
            read: 0,
        });
    }
    let mut buf = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, resp.chunk()).await {
            Err(_) => return Err(BodyError::Deadline(buf.len())),
            Ok(Err(e)) => return Err(BodyError::Lost(buf.len(), error_chain(&e))),
            Ok(Ok(None)) => return Ok(Bytes::from(buf)),
            Ok(Ok(Some(chunk))) => {
                if buf.len() + chunk.len() > cap {
                    return Err(BodyError::TooLarge {
                        cap,
                        announced: None,
                        read: buf.len() + chunk.len(),
                    });
                }
                buf.extend_from_slice(&chunk);
            }
        }
    }
}
