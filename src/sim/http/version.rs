//! What Nova's API does around every call of its versioned API (`/v2.1`
//! and below), as the differential test against real Nova 34 found it
//! (`tests/real_nova/differential.rs`):
//!
//! - the microversion is negotiated first: `OpenStack-API-Version: compute
//!   X` wins over the legacy `X-OpenStack-Nova-API-Version`, none means
//!   2.1, `latest` the maximum; a malformed one is 400 (without version
//!   headers), one out of range 406 `computeFault` (echoing it);
//! - every answer carries Nova's request id (`X-OpenStack-Request-Id` and
//!   `X-Compute-Request-Id`), a 401 of the auth middleware and a 400 of
//!   schema validation included;
//! - an answer with a negotiated version says `Vary` for both headers;
//! - a fault's message is in the request's `Accept-Language`, when Nova
//!   has a translation for it (`i18n.rs`).
//!
//! The auth middleware runs before the negotiation: a request without a
//! valid token is 401, whatever its version header.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Response};
use axum::middleware::Next;
use uuid::Uuid;

use super::i18n::{self, NovaFault};
use super::{AppState, json};

/// Nova 34's range (`nova/api/openstack/api_version_request.py`).
pub(super) const MIN: (u32, u32) = (2, 1);
pub(super) const MAX: (u32, u32) = (2, 104);

/// The version string a request asks for, as microversion_parse reads it:
/// `None` when it names none.
fn asked(h: &HeaderMap) -> Option<String> {
    let new = h
        .get_all("openstack-api-version")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|part| {
            let mut it = part.split_whitespace();
            match (it.next(), it.next()) {
                (Some(service), Some(version)) if service.eq_ignore_ascii_case("compute") => {
                    Some(version.to_string())
                }
                _ => None,
            }
        });
    new.or_else(|| {
        h.get("x-openstack-nova-api-version")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_string())
    })
}

/// `MajorNum.MinorNum` without leading zeros (Nova's pattern), or `None`.
fn parse(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.split_once('.')?;
    let ok = |p: &str, zero_ok: bool| {
        !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_digit())
            && (p == "0" && zero_ok || !p.starts_with('0'))
    };
    if !ok(major, false) || !ok(minor, true) {
        return None;
    }
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The negotiated version, or Nova's refusal.
// The error is the answer itself.
#[allow(clippy::result_large_err)]
pub(super) fn negotiate(h: &HeaderMap) -> Result<(u32, u32), Response<Body>> {
    let Some(s) = asked(h) else { return Ok(MIN) };
    if s == "latest" {
        return Ok(MAX);
    }
    let Some(mv) = parse(&s) else {
        return Err(json(
            400,
            serde_json::json!({"badRequest": {"code": 400, "message": format!(
                "API Version String {s} is of invalid format. Must be of format MajorNum.MinorNum."
            )}}),
            (0, 0),
        ));
    };
    if mv < MIN || mv > MAX {
        return Err(json(
            406,
            serde_json::json!({"computeFault": {"code": 406, "message": format!(
                "Version {}.{} is not supported by the API. Minimum is {}.{} and maximum is {}.{}.",
                mv.0, mv.1, MIN.0, MIN.1, MAX.0, MAX.1
            )}}),
            mv,
        ));
    }
    Ok(mv)
}

/// The layer on the versioned API: negotiation, request ids, `Vary`.
pub(super) async fn layer(
    State(st): State<AppState>,
    mut req: Request,
    next: Next,
) -> Response<Body> {
    let language = req
        .headers()
        .get("accept-language")
        .and_then(|v| v.to_str().ok())
        .and_then(|asked| i18n::best_match(asked, &st.sim.config().locales));
    let path = req.uri().path();
    let version_document = path == "/v2.1" || path == "/v2.1/";
    let token = req
        .headers()
        .get("x-auth-token")
        .and_then(|v| v.to_str().ok());
    let authenticated = version_document || st.sim.token_ok(token);
    let mut resp = if authenticated {
        match negotiate(req.headers()) {
            Ok(mv) => {
                // Handlers read the negotiated version from one header.
                let h = req.headers_mut();
                h.remove("x-openstack-nova-api-version");
                if let Ok(v) = HeaderValue::from_str(&format!("compute {}.{}", mv.0, mv.1)) {
                    h.insert("openstack-api-version", v);
                }
                next.run(req).await
            }
            Err(refused) => refused,
        }
    } else {
        // The handler answers the auth middleware's 401.
        next.run(req).await
    };
    if language.is_some()
        && let Some(fault) = resp.extensions_mut().remove::<NovaFault>()
    {
        *resp.body_mut() = Body::from(fault.translated().to_string());
        resp.headers_mut()
            .remove(axum::http::header::CONTENT_LENGTH);
    }
    let h = resp.headers_mut();
    if !h.contains_key("x-openstack-request-id")
        && let Ok(v) = HeaderValue::from_str(&format!("req-{}", Uuid::new_v4()))
    {
        h.insert("x-compute-request-id", v.clone());
        h.insert("x-openstack-request-id", v);
    }
    if h.contains_key("openstack-api-version") && !h.contains_key("vary") {
        h.append("vary", HeaderValue::from_static("OpenStack-API-Version"));
        h.append(
            "vary",
            HeaderValue::from_static("X-OpenStack-Nova-API-Version"),
        );
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn negotiates_as_nova_does() {
        assert_eq!(negotiate(&headers(&[])).unwrap(), (2, 1));
        let latest = headers(&[("openstack-api-version", "compute latest")]);
        assert_eq!(negotiate(&latest).unwrap(), (2, 104));
        let both = headers(&[
            ("x-openstack-nova-api-version", "2.5"),
            ("openstack-api-version", "compute 2.60"),
        ]);
        assert_eq!(negotiate(&both).unwrap(), (2, 60), "the new header wins");
        let legacy = headers(&[("x-openstack-nova-api-version", "2.5")]);
        assert_eq!(negotiate(&legacy).unwrap(), (2, 5));
        let other = headers(&[("openstack-api-version", "volume 3.27")]);
        assert_eq!(negotiate(&other).unwrap(), (2, 1), "another service's");
        for (v, status) in [("2.105", 406), ("3.0", 406), ("abc", 400), ("2.01", 400)] {
            let h = headers(&[("openstack-api-version", v)]);
            // `v` alone names no service: the header is ignored.
            assert!(negotiate(&h).is_ok(), "{v}");
            let mut h = HeaderMap::new();
            h.insert(
                "openstack-api-version",
                HeaderValue::from_str(&format!("compute {v}")).unwrap(),
            );
            let r = negotiate(&h).expect_err(v);
            assert_eq!(r.status().as_u16(), status, "{v}");
        }
    }
}
