//! An HTTP/1.1 proxy that adds headers to every request it passes on: what
//! a gateway, an ingress or a corporate proxy in front of Nova may do
//! (an `Accept-Language` of its own, say). Real sockets both ways; the
//! answers come back as they were, and a connection the upstream closed
//! without answering is closed the same way.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub struct HeaderProxy {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl HeaderProxy {
    /// A proxy to `upstream` (`http://host:port`) adding `headers` to each
    /// request (replacing any of the same name).
    pub async fn start(upstream: &str, headers: &[(&'static str, &str)]) -> HeaderProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let stop = CancellationToken::new();
        let relay = Relay {
            upstream: upstream.trim_end_matches('/').to_string(),
            headers: headers.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("a client"),
        };
        let s = stop.clone();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = s.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            eprintln!("header proxy: accept failed: {e}");
                            continue;
                        }
                    },
                };
                let relay = relay.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let relay = relay.clone();
                        async move { relay.pass(req).await }
                    });
                    // A connection ends with an error when the upstream's
                    // was closed without an answer: that is the point.
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        eprintln!("header proxy: connection ended: {e}");
                    }
                });
            }
        });
        HeaderProxy { addr, stop }
    }

    /// `http://127.0.0.1:port`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for HeaderProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct Relay {
    upstream: String,
    headers: Vec<(&'static str, String)>,
    client: reqwest::Client,
}

impl Relay {
    async fn pass(
        &self,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Full<Bytes>>, std::io::Error> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut out = self
            .client
            .request(parts.method, format!("{}{path}", self.upstream))
            .body(body);
        for (name, value) in &parts.headers {
            if name != "host" && name != "content-length" {
                out = out.header(name, value);
            }
        }
        let mut out = out.build().map_err(std::io::Error::other)?;
        for (name, value) in &self.headers {
            let value = value.parse().map_err(std::io::Error::other)?;
            out.headers_mut().insert(*name, value);
        }
        // An upstream that closed without answering: close this one too.
        let answer = self
            .client
            .execute(out)
            .await
            .map_err(std::io::Error::other)?;
        let mut resp = hyper::Response::builder().status(answer.status());
        for (name, value) in answer.headers() {
            if name != "content-length" && name != "transfer-encoding" {
                resp = resp.header(name, value);
            }
        }
        let body = answer.bytes().await.map_err(std::io::Error::other)?;
        resp.body(Full::new(body)).map_err(std::io::Error::other)
    }
}
