//! The Rust client against the real server: keyed retries absorb transport
//! failures within the caller's deadline, and never outlive it.

mod support;

use std::sync::Mutex;
use std::time::Duration;

use support::{AppOptions, eventually, spawn_app, uuid};
use tokio::time::Instant;
use tonic::Code;
use volume_reconciler::client::{Client, RetryStats};

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test]
async fn a_call_made_before_the_server_is_up_is_retried_with_its_key_until_it_lands() {
    support::init_logs();
    let addr = free_addr();
    let client = Client::connect_lazy(&format!("http://{addr}")).unwrap();
    let stats = std::sync::Arc::new(Mutex::new(RetryStats::default()));
    let (s, v) = (uuid(), uuid());
    let call = tokio::spawn({
        let (client, stats, s, v) = (client.clone(), stats.clone(), s.clone(), v.clone());
        async move {
            client
                .attach_counted("early-1", &s, &v, Duration::from_secs(30), &stats)
                .await
        }
    });
    // Nothing listens yet: the call fails to connect and pauses, again and again.
    eventually(
        Duration::from_secs(10),
        "a refused connection is retried",
        || {
            let stats = stats.clone();
            async move { stats.lock().unwrap().retries >= 2 }
        },
    )
    .await;
    let app = spawn_app(AppOptions::default().arg("--listen", &addr.to_string())).await;
    let op = call.await.unwrap().expect("the retried call lands");
    let retries = stats.lock().unwrap().clone();
    assert!(
        retries.by_code.get("Unavailable").copied().unwrap_or(0) >= 2,
        "{retries:?}"
    );
    let row = app
        .store
        .operation_get_by_key("early-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.id.to_string(), op.id, "one operation for the key");
    assert_eq!(app.sim.attach_effects(v.parse().unwrap()), 1);
    app.stop().await;
}

#[tokio::test]
async fn retries_stop_at_the_callers_deadline() {
    let addr = free_addr();
    let client = Client::connect_lazy(&format!("http://{addr}")).unwrap();
    let started = Instant::now();
    let err = client
        .attach(
            "late-1",
            &uuid(),
            &uuid(),
            Default::default(),
            Duration::from_millis(600),
        )
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err.code, Code::Unavailable | Code::DeadlineExceeded),
        "{err}"
    );
    assert!(err.retries >= 1, "it did retry: {err}");
    // Wide margin for a loaded machine, but never long past the deadline.
    assert!(took < Duration::from_secs(3), "took {took:?}");
}
