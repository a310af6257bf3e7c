//! One send loop for attach and detach: check the budget → record the
//! attempt → send → classify the answer (`classify.rs`) → carry out the
//! step it names (look, watch, retry, decide).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::domain::{Action, AttachmentInfo, NewEvent, OperationError, Reason, Resolution, event};
use crate::nova::{AttachAnswer, NovaError, RequestId};

use super::Executor;
use super::classify::{self, Answer, Next, Until, Verdict};
use super::run::{Decision, Fenced, Run, Seen};

/// What carrying out a step led to.
enum Acted {
    Decided(Decision),
    /// Send again after the pause slept; the step stands for the row's own
    /// alternative (`retry, else ...`), for when no request fits after all.
    SendAgain(Next),
}

/// What a step may draw on: the answer's error and the attachment last
/// seen (in Nova's 200 or a look).
struct Context<'a> {
    error: Option<&'a NovaError>,
    attachment: Option<AttachmentInfo>,
}

type Step<'s> = Pin<Box<dyn Future<Output = Acted> + Send + 's>>;

/// What one request returned, owned (the loop keeps it across steps).
#[derive(Debug)]
enum Sent {
    Done(AttachmentInfo),
    Accepted,
    Failed(NovaError),
}

impl Executor {
    /// Sends until a step decides. `first_sent`: the first request's intent
    /// is already recorded (its attempt counted).
    pub(crate) async fn send_loop(
        self: &Arc<Self>,
        run: &mut Run,
        first_sent: bool,
    ) -> Result<Decision, Fenced> {
        let mut need_record = !first_sent;
        // The last answer and its row's alternative, once a pause was slept
        // to send again: the pause fitted, but the runtime may wake late, or
        // the next attempt may not be recorded in time. Then no request fits
        // after all, and the alternative decides with that answer, as it
        // would have had the pause not fitted (a connect refused all along
        // is NOVA_UNREACHABLE, not a deadline that came before any send).
        let mut paused: Option<(Sent, Next, classify::History)> = None;
        loop {
            let now = Instant::now();
            if !self.policy.can_send_again(&run.budget, now) {
                return Ok(self
                    .no_request_fits(run, paused, "no time left to send again")
                    .await);
            }
            let outbound = self.policy.outbound(&run.budget, now);
            if need_record && !Box::pin(self.record_attempt(run)).await? {
                // The attempt's intent could not be recorded by the
                // deadline: it is not sent (its earlier requests took no
                // effect, or it would not be sending again).
                return Ok(self
                    .no_request_fits(run, paused, "the next attempt could not be recorded")
                    .await);
            }
            need_record = true;
            // This request brings its own answer: a run waiting on Nova
            // holds no earlier one.
            drop(paused.take());
            self.metrics
                .nova
                .outbound_deadline
                .observe(outbound.saturating_duration_since(now).as_secs_f64());
            let sent = Box::pin(self.send(run, outbound)).await;
            let (answer, may_take_effect, attachment) = match &sent {
                Sent::Done(a) => (Answer::Done, true, Some(a.clone())),
                Sent::Accepted => (Answer::Accepted, true, None),
                Sent::Failed(e) => (Answer::Failed(e), e.outcome_unknown(), None),
            };
            let history = run.history(may_take_effect);
            run.maybe_effect |= may_take_effect;
            let next = classify::classify_answer(run.op.action, run.op.server_id, &answer);
            let mut ctx = Context {
                error: match &sent {
                    Sent::Failed(e) => Some(e),
                    _ => None,
                },
                attachment,
            };
            let acted = self.step(run, next, &mut ctx, history).await;
            match acted {
                Acted::Decided(d) => return Ok(d),
                Acted::SendAgain(otherwise) => paused = Some((sent, otherwise, history)),
            }
        }
    }

    /// No request may be sent again: the alternative of the answer before
    /// the pause decides, with that answer (see `paused` in `send_loop`);
    /// with no such answer, out of time.
    async fn no_request_fits(
        self: &Arc<Self>,
        run: &mut Run,
        paused: Option<(Sent, Next, classify::History)>,
        why: &'static str,
    ) -> Decision {
        let Some((sent, otherwise, history)) = paused else {
            return self.out_of_time(run, why).await;
        };
        let mut ctx = Context {
            error: match &sent {
                Sent::Failed(e) => Some(e),
                _ => None,
            },
            attachment: None,
        };
        match self.step(run, otherwise, &mut ctx, history).await {
            Acted::Decided(d) => d,
            // An alternative never asks to send again.
            Acted::SendAgain(_) => Decision::unknown(self.unknown_error(run, ctx.error, why)),
        }
    }

    /// No request may be sent again: decide from what can still be seen
    /// (`Next::OutOfTime`), else UNKNOWN because of `why`.
    async fn out_of_time(self: &Arc<Self>, run: &mut Run, why: &'static str) -> Decision {
        let history = run.history(false);
        let mut ctx = Context {
            error: None,
            attachment: None,
        };
        match self.step(run, Next::OutOfTime, &mut ctx, history).await {
            Acted::Decided(d) => d,
            // A look never asks to send; out of time it cannot.
            Acted::SendAgain(_) => Decision::unknown(self.unknown_error(run, None, why)),
        }
    }

    /// Sends the run's request once (under the operation's global request
    /// id) and logs it and what came back, with Nova's own request id.
    ///
    /// The request's own line is made once the request is over, stamped
    /// with when it started: nothing reads the run's events meanwhile (the
    /// run is borrowed here; a run dropped during the wait writes none), so
    /// thousands of runs waiting on Nova, or on its per-host cap, hold no
    /// event's strings while they wait (~0.8 KB each, measured with
    /// thousands of runs held by Nova's per-host cap).
    async fn send(self: &Arc<Self>, run: &mut Run, outbound: Instant) -> Sent {
        let started = Instant::now();
        let op = &run.op;
        let name = op.action.as_str();
        let rid = RequestId::for_operation(op.id);
        let gate =
            super::gate::LeaseGate::new(self, op.id, outbound, op.attempts, op.caller.as_deref());
        let (sent, nova_id) = match op.action {
            Action::Attach => match self
                .nova
                .attach_gated(
                    &rid,
                    op.server_id,
                    op.volume_id,
                    &op.params,
                    outbound,
                    &gate,
                )
                .await
            {
                Ok(a) => (
                    match a.value {
                        AttachAnswer::Attached(att) => Sent::Done(att.to_info()),
                        AttachAnswer::Accepted => Sent::Accepted,
                    },
                    a.nova_request_id,
                ),
                Err(e) => (Sent::Failed(e), None),
            },
            Action::Detach => match self
                .nova
                .detach_gated(&rid, op.server_id, op.volume_id, outbound, &gate)
                .await
            {
                Ok(a) => (Sent::Accepted, a.nova_request_id),
                Err(e) => (Sent::Failed(e), None),
            },
        };
        let elapsed = started.elapsed();
        if let Some(left) = gate.left_at() {
            run.last_left_at = Some(left);
        }
        run.events.push(super::ledger::request_sent_event(
            run.op.id,
            run.op.action,
            run.op.attempts,
            outbound,
            started,
        ));
        let answered = |ev: NewEvent| match &nova_id {
            Some(id) => ev.with("nova_request_id", id),
            None => ev,
        };
        match &sent {
            Sent::Done(_) => {
                self.metrics.nova.request(name, "ok", elapsed.as_secs_f64());
                run.events.push(answered(
                    NewEvent::new(event::RESPONSE, "Nova answered 200: attachment created")
                        .with("http_status", 200)
                        .with("elapsed_ms", elapsed.as_millis()),
                ));
            }
            Sent::Accepted => {
                self.metrics
                    .nova
                    .request(name, "accepted", elapsed.as_secs_f64());
                run.events.push(answered(
                    NewEvent::new(
                        event::RESPONSE,
                        format!("Nova answered 202: {name} accepted; watching the attachment list"),
                    )
                    .with("http_status", 202)
                    .with("elapsed_ms", elapsed.as_millis()),
                ));
            }
            Sent::Failed(e) => self.note_failure(run, e),
        }
        sent
    }

    /// Carries out one step, and the steps it leads to, until one decides
    /// or asks to send again.
    fn step<'s>(
        self: &'s Arc<Self>,
        run: &'s mut Run,
        next: Next,
        ctx: &'s mut Context<'_>,
        history: classify::History,
    ) -> Step<'s> {
        // Boxed: steps nest (a look leads to a retry leads to a decision).
        Box::pin(async move {
            let then = match next {
                Next::Decide(v) => return Acted::Decided(self.verdict(run, v, ctx)),
                Next::Retry { why, otherwise } => {
                    if let Some(watch) = classify::no_resend(run.op.action, history) {
                        // A request that may still take effect: sending
                        // another could make a second effect for the key.
                        watch
                    } else if self.backoff(run, why).await {
                        return Acted::SendAgain(*otherwise);
                    } else {
                        *otherwise
                    }
                }
                Next::Observe {
                    until,
                    attached,
                    absent,
                    error,
                } => {
                    let until = self.until(run, until);
                    match self.observe(run, until).await {
                        Ok(Seen::Attached(a)) => {
                            ctx.attachment = Some(a);
                            *attached
                        }
                        Ok(Seen::Absent | Seen::ServerGone) => *absent,
                        Err(_) => *error,
                    }
                }
                Next::LookServer {
                    until,
                    gone,
                    present,
                    error,
                } => {
                    let until = self.until(run, until);
                    match self.look_at_server(run, until).await {
                        Ok(false) => *gone,
                        Ok(true) => *present,
                        Err(_) => *error,
                    }
                }
                Next::Watch {
                    want,
                    until,
                    found,
                    otherwise,
                } => {
                    let until = self.until(run, until);
                    match self.observe_until(run, want, until).await {
                        Some(seen) => {
                            if let Seen::Attached(a) = seen {
                                ctx.attachment = Some(a);
                            }
                            return Acted::Decided(self.verdict(run, found, ctx));
                        }
                        None => *otherwise,
                    }
                }
                Next::Refuse(reason) => classify::refuse(run.op.action, history, reason),
                Next::OutOfTime => classify::out_of_time(run.op.action, history),
            };
            self.step(run, then, ctx, history).await
        })
    }

    /// The instant a look or watch named by `until` ends.
    fn until(&self, run: &Run, until: Until) -> Instant {
        let now = Instant::now();
        match until {
            Until::ObserveBy => run.budget.observe_by(),
            Until::AnswerByAtLeast1s => run.budget.answer_by.max(now + Duration::from_secs(1)),
        }
    }

    /// A verdict with its data: the attachment, the error and its context.
    fn verdict(&self, run: &Run, v: Verdict, ctx: &Context<'_>) -> Decision {
        match v {
            Verdict::Succeeded {
                resolution,
                detail,
                recovered,
            } => {
                if recovered {
                    self.metrics.responses_recovered.inc();
                }
                let attachment = match run.op.action {
                    Action::Attach => ctx.attachment.clone(),
                    Action::Detach => None,
                };
                Decision::succeeded(resolution, attachment, detail)
            }
            Verdict::Failed { reason } => {
                let err = match ctx.error {
                    Some(e) => {
                        let mut err = OperationError::new(
                            reason,
                            format!(
                                "{}: {}",
                                e.clock(),
                                e.message.clone().unwrap_or_else(|| e.cause.clone())
                            ),
                        )
                        .with("operation_id", run.op.id);
                        err.metadata.extend(e.metadata());
                        err
                    }
                    None => OperationError::new(
                        reason,
                        "the deadline came before any request could be sent",
                    )
                    .with("operation_id", run.op.id),
                };
                Decision::failed(Resolution::Response, err)
            }
            Verdict::FailedElsewhere => {
                Decision::failed(Resolution::Response, self.elsewhere(run, ctx))
            }
            Verdict::Unknown { message } => {
                Decision::unknown(self.unknown_error(run, ctx.error, message))
            }
        }
    }

    /// The error of an attach refused because another server holds the
    /// volume, naming the servers Nova named.
    fn elsewhere(&self, run: &Run, ctx: &Context<'_>) -> OperationError {
        let ours = run.op.server_id.to_string();
        let servers: Vec<String> = match ctx.error.map(|e| &e.kind) {
            Some(crate::nova::NovaErrorKind::Rejected(
                crate::nova::Rejection::AlreadyAttached { servers },
            )) => servers.iter().filter(|s| **s != ours).cloned().collect(),
            _ => Vec::new(),
        };
        let mut err = OperationError::new(
            Reason::AlreadyAttachedElsewhere,
            format!(
                "volume {} is attached to another server: {}",
                run.op.volume_id,
                servers.join(" ")
            ),
        )
        .with("attached_to", servers.join(" "))
        .with("operation_id", run.op.id);
        if let Some(e) = ctx.error {
            err.metadata.extend(e.metadata());
        }
        err
    }

    pub(crate) fn unknown_error(
        &self,
        run: &Run,
        e: Option<&NovaError>,
        message: &str,
    ) -> OperationError {
        let mut err = OperationError::new(Reason::OutcomeUnknown, message)
            .with("operation_id", run.op.id)
            .with("attempts", run.op.attempts);
        if let Some(e) = e {
            err.metadata.extend(e.metadata());
            err = err.with("last_failure", e.reason());
        }
        err
    }

    /// Sleeps the run's next backoff pause if another request still fits
    /// before `send_by` after it; false (without sleeping) when none fits.
    async fn backoff(&self, run: &mut Run, why: &str) -> bool {
        let Some(pause) = run.backoff.next() else {
            return false;
        };
        let resume = Instant::now() + pause;
        if !self.policy.can_send_again(&run.budget, resume) {
            return false;
        }
        run.events.push(
            NewEvent::new(
                event::RETRY_SCHEDULED,
                format!("retrying after {} ms: {why}", pause.as_millis()),
            )
            .with("pause_ms", pause.as_millis())
            .with("cancellable", true),
        );
        // Only refusals that prove nothing took effect, with nothing
        // earlier that may, are sent again after a pause (`no_resend`):
        // the row says so while the run pauses.
        self.mark_paused(run).await;
        tokio::time::sleep_until(resume).await;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use uuid::Uuid;

    use super::*;
    use crate::domain::deadline::{BudgetPolicy, Deadline};
    use crate::executor::metrics::ExecutorMetrics;
    use crate::executor::{ExecSettings, ledger};
    use crate::nova::NovaClient;
    use crate::store::Store;

    /// An executor on an in-memory ledger, sending to Nova at `nova_url`.
    async fn executor_on(nova_url: String) -> Arc<Executor> {
        let store: Arc<dyn Store> = Arc::new(
            crate::store::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        Executor::new(
            store,
            Arc::new(NovaClient::new(crate::nova::NovaConfig {
                endpoint: crate::nova::NovaEndpoint::Direct(nova_url),
                ..Default::default()
            })),
            BudgetPolicy::default(),
            "r".into(),
            ExecSettings::default(),
            ExecutorMetrics::unscraped(),
        )
    }

    /// A run of a fresh attach of `volume` to `server` within `deadline`,
    /// with its lease known to hold (the gate lets its requests out) while
    /// the returned hold lives.
    fn held_run(
        exec: &Arc<Executor>,
        server: Uuid,
        volume: Uuid,
        deadline: Duration,
    ) -> (Run, crate::executor::holds::Hold) {
        let budget = BudgetPolicy::default()
            .plan(Instant::now(), Instant::now() + deadline)
            .unwrap();
        let req = crate::executor::test_request(server, volume);
        let at = chrono::Utc::now();
        let op = exec
            .intent(&req, Deadline::none(), &budget, Instant::now())
            .recorded_as(at, at, None, None);
        let hold = exec.holds.hold(op.id, Some(1));
        exec.holds
            .confirm(&[op.id], Instant::now() + Duration::from_secs(60));
        (Run::new(op, budget, false), hold)
    }

    /// A run whose request is refused at connect (nobody listens) pauses to
    /// send again; the runtime then wakes it too late for another request
    /// (a loaded machine; here its one thread is held past the deadline).
    /// The pause's alternative decides with the answer before it: every
    /// request was refused, so NOVA_UNREACHABLE with its error class, not
    /// a deadline "before any request could be sent".
    #[tokio::test]
    async fn a_pause_that_wakes_too_late_to_send_decides_with_the_answer_before_it() {
        let nobody = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let exec = executor_on(format!("http://{nobody}/v2.1")).await;
        let (mut run, _hold) = held_run(
            &exec,
            Uuid::new_v4(),
            Uuid::new_v4(),
            Duration::from_secs(3),
        );
        // As `drive` does: the intent counted the first request, not sent yet.
        run.maybe_effect = false;
        let held_past = run.budget.answer_by + Duration::from_millis(100);

        // The failure is noted just before the pause, with no await between
        // them: once it shows, the run sleeps in its pause (the test's one
        // thread runs both), and holding the thread makes the pause overrun.
        let hold_thread_in_the_pause = async {
            while exec.failures.flush(Duration::from_secs(10)) == 0 {
                tokio::task::yield_now().await;
            }
            std::thread::sleep(held_past.saturating_duration_since(Instant::now()));
        };
        let (decided, ()) = tokio::join!(exec.send_loop(&mut run, true), hold_thread_in_the_pause);
        let Ok(d) = decided else { panic!("fenced") };
        assert_eq!(d.state, crate::domain::State::Failed, "{:?}", d.error);
        let err = d.error.expect("a failure's error");
        assert_eq!(err.reason, Reason::NovaUnreachable, "{err:?}");
        assert_eq!(
            err.metadata.get("error_class").map(String::as_str),
            Some("connect_failed"),
            "{err:?}"
        );
        assert_eq!(run.op.attempts, 1, "no second request: {err:?}");
        assert!(
            run.events.iter().any(|e| e.kind == event::RETRY_SCHEDULED),
            "the run paused to send again: {:?}",
            run.events
        );
    }

    /// Thousands of runs wait on Nova (or its per-host cap) at once: while
    /// one waits it holds no event (a request's line, ~0.8 KB of strings,
    /// is made once the request is over), and the line it makes then is
    /// stamped with when the request started, so the log reads as before.
    /// Long on purpose: one run against the simulator, held at Nova, looked
    /// at while it waits and after, in the order the log is written.
    #[tokio::test]
    async fn a_run_waiting_on_nova_holds_no_event_and_stamps_the_request_when_it_started() {
        let sim = crate::sim::start(
            "127.0.0.1:0".parse().unwrap(),
            crate::sim::SimConfig::default(),
        )
        .await
        .unwrap();
        let exec = executor_on(sim.nova_url.clone()).await;
        let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
        let delay = Duration::from_millis(400);
        sim.sim.add_fault(
            crate::sim::FaultRule::new(
                crate::sim::FaultOp::Attach,
                crate::sim::Fault::DelayAfterEffect {
                    ms: delay.as_millis() as u64,
                },
            )
            .always(),
        );
        let (mut run, _hold) = held_run(&exec, server, volume, Duration::from_secs(60));
        let outbound = Instant::now() + Duration::from_secs(30);

        // Waiting on Nova (the simulator has the request and holds its
        // answer): the send is stopped there, and the run holds nothing.
        {
            let send = exec.send(&mut run, outbound);
            tokio::pin!(send);
            let reached = async {
                while sim.sim.attach_requests(volume) == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                // The request counted comes first: on a starved test
                // thread the answer may be ready in the same round.
                biased;
                () = reached => {}
                sent = &mut send => panic!("answered before its delay: {sent:?}"),
                () = tokio::time::sleep(Duration::from_secs(30)) => panic!("the request never reached the simulator"),
            }
        }
        assert!(
            run.events.is_empty(),
            "a run waiting on Nova holds its events: {:?}",
            run.events
        );

        // Answered (another volume: the first one's attach took effect):
        // the request's line, then Nova's, the first stamped with when the
        // request started (a log time the delay earlier).
        run.op.volume_id = Uuid::new_v4();
        let started = Instant::now();
        let sent = exec.send(&mut run, outbound).await;
        assert!(matches!(sent, Sent::Done(_)), "{sent:?}");
        let kinds: Vec<&str> = run.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [event::REQUEST_SENT, event::RESPONSE]);
        let events = ledger::written_now(&mut run.events);
        assert!(
            events[0].ago >= delay && events[0].ago <= started.elapsed(),
            "the request's line is {:?} before its write, the request took {:?}",
            events[0].ago,
            started.elapsed()
        );
        assert!(events[1].ago < delay, "Nova's line: {:?}", events[1].ago);
        sim.stop().await;
    }
}
