//! The send gate asked again once a new connection is ready: reqwest
//! connects (TCP, then TLS: up to `--nova-connect-timeout` and
//! `--nova-tls-handshake-timeout`) after the gate was asked, and a lease
//! known to hold then may have ended by the time the request's first byte
//! is written. So the request's gate travels with it (a task-local value
//! around the send), and a layer on reqwest's connector asks it again when
//! the connection it made is ready — the last moment before hyper writes
//! the request, as reqwest exposes none later. A refusal there fails the
//! connection, and the request fails as withheld: nothing was sent.
//!
//! A request that goes out on a pooled connection made no connection of its
//! own: its gate was asked just before, with nothing slow in between.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

tokio::task_local! {
    /// The gate of the request being sent in this task, if it has one.
    static GATE: Arc<dyn SendGate>;
}

/// Runs `send` with `gate` asked again when a new connection is ready.
pub(crate) async fn scoped<F: Future>(gate: Arc<dyn SendGate>, send: F) -> F::Output {
    GATE.scope(gate, send).await
}

/// The gate refused once the connection was ready.
#[derive(Debug, thiserror::Error)]
#[error("not sent: {0}")]
pub(crate) struct Withheld(pub String);

/// Why the gate refused, if that is what ended `e` (anywhere in its chain
/// of sources: reqwest and hyper wrap the connector's error).
pub(crate) fn withheld(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(w) = err.downcast_ref::<Withheld>() {
            return Some(w.0.clone());
        }
        cur = err.source();
    }
    None
}

/// reqwest's connector, with the gate asked once the connection is ready.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GateLayer;

impl<S> tower::Layer<S> for GateLayer {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GateService(inner)
    }
}

#[derive(Clone, Debug)]
pub(crate) struct GateService<S>(S);

impl<S, R> tower::Service<R> for GateService<S>
where
    S: tower::Service<R, Error = BoxError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<S::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        // Read now, in the request's task: hyper may finish a connection it
        // no longer needs in a task of its own (the request found a pooled
        // one first); that one asks the gate of the request that began it.
        let gate = GATE.try_with(Arc::clone).ok();
        let connecting = self.0.call(req);
        Box::pin(async move {
            let conn = connecting.await?;
            if let Some(gate) = gate {
                gate.may_send()
                    .await
                    .map_err(|why| Box::new(Withheld(why)) as BoxError)?;
            }
            Ok(conn)
        })
    }
}

/// Asked right before a request leaves, once its slot and token are had
/// (a wait for either may be long), and again once a connection made for
/// it is ready (`owned`, with `scoped` above): `Err(why)` keeps it from leaving,
/// and the request fails as `Withheld`, not sent. The executor's gate makes
/// sure its operation's lease still holds, so a request never leaves after
/// another replica may have taken the operation over, and notes the instant
/// it left.
pub trait SendGate: Send + Sync {
    fn may_send(&self) -> futures_util::future::BoxFuture<'_, Result<(), String>>;

    /// The gate as a value the connection's setup can carry, to be asked
    /// again when a new connection is ready; `None`: asked once only.
    fn owned(&self) -> Option<Arc<dyn SendGate>> {
        None
    }

    /// The caller row whose share of Nova's request slots the request
    /// counts against (`fair`); `None`: the last row's (the default row,
    /// and requests of no caller's).
    fn share(&self) -> Option<usize> {
        None
    }
}

/// A gate that is always open (reads, and requests no lease guards).
pub struct Open;

impl SendGate for Open {
    fn may_send(&self) -> futures_util::future::BoxFuture<'_, Result<(), String>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::io::AsyncReadExt as _;
    use tokio::time::Instant;
    use uuid::Uuid;

    use super::*;
    use crate::nova::{NovaClient, NovaConfig, NovaEndpoint, NovaErrorKind, RequestId};

    /// Open when first asked (before the connection), closed when asked
    /// again, counting the times asked.
    #[derive(Clone)]
    struct ClosesOnceConnected(Arc<AtomicUsize>);

    impl SendGate for ClosesOnceConnected {
        fn may_send(&self) -> BoxFuture<'_, Result<(), String>> {
            let n = self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(std::future::ready(if n == 0 {
                Ok(())
            } else {
                Err("the lease ended while connecting".into())
            }))
        }

        fn owned(&self) -> Option<Arc<dyn SendGate>> {
            Some(Arc::new(self.clone()))
        }
    }

    /// The gate is asked again after the connection is made and before the
    /// request's first byte: closed then, the server sees a connection and
    /// not one byte, and the request fails as withheld (not sent).
    #[tokio::test]
    async fn a_gate_that_closes_once_the_connection_is_ready_keeps_the_request_from_leaving() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            // Until the client closes its end.
            conn.read_to_end(&mut got).await.unwrap_or_default();
            got.len()
        });
        let nova = NovaClient::new(NovaConfig {
            endpoint: NovaEndpoint::Direct(format!("http://{addr}/v2.1")),
            ..Default::default()
        });
        let asked = Arc::new(AtomicUsize::new(0));
        let gate = ClosesOnceConnected(asked.clone());
        let sent = nova
            .detach_gated(
                &RequestId::fresh(),
                Uuid::new_v4(),
                Uuid::new_v4(),
                Instant::now() + Duration::from_secs(10),
                &gate,
            )
            .await;
        let err = sent.expect_err("the gate closed");
        assert_eq!(err.kind, NovaErrorKind::Withheld, "{err}");
        assert!(!err.outcome_unknown(), "a withheld request took no effect");
        assert!(
            err.cause.contains("the lease ended while connecting"),
            "{err}"
        );
        assert_eq!(
            asked.load(Ordering::SeqCst),
            2,
            "asked before and after connecting"
        );
        drop(nova);
        let bytes = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the client closed the connection")
            .unwrap();
        assert_eq!(bytes, 0, "the request's bytes left after the gate closed");
    }
}
