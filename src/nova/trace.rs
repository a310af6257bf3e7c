//! The trace of the work at hand on every request to OpenStack (Nova,
//! Cinder, Keystone): the client (`http.rs`) and Keystone authentication
//! (`auth.rs`) both send through it.

/// The request with the trace of the work at hand, if any (W3C
/// `traceparent`: its trace id, this service's span as the parent; the
/// caller's `tracestate`), so the service's logs join ours by trace id.
pub(crate) fn with_trace(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match crate::telemetry::context::current() {
        Some(ctx) => {
            let req = req.header("traceparent", ctx.traceparent());
            match ctx.tracestate() {
                Some(state) => req.header("tracestate", state),
                None => req,
            }
        }
        None => req,
    }
}
