package volumereconciler

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Pauses between replays: from 20 ms, doubling, at most 1 s, each drawn at
// random between half and all of it so that callers cut off together (a
// replica draining) do not come back together. There is no count limit and
// no time limit of the client's own: the caller's context ends the
// replays.
const (
	firstPause = 20 * time.Millisecond
	maxPause   = time.Second
)

// replayFloor is the least time a replay is sent into. Less is not enough
// for the service to be asked and to answer: it keeps a margin (at least
// 50 ms, 5 % of the time) to answer before the deadline, and a replay that
// joins an open operation answers at that margin; with less than this left
// the replay's answer races the caller's own deadline, and what comes back
// is the transport's bare DEADLINE_EXCEEDED, which names no operation.
// Below it the answer already in hand (the OUTCOME_UNKNOWN that named the
// operation) is returned instead.
const replayFloor = 250 * time.Millisecond

// replay sends call until it answers an operation, an error that a replay
// cannot change, or ctx has too little time left for another try; always
// with the same request (the same idempotency key, or the same identity of
// an ensure call). Of the answers, the one returned is the last, unless the
// last lost the operation id an earlier one named: then the earlier one,
// with the last in its Last.
func replay[T any](ctx context.Context, method string, call func(context.Context) (T, error)) (T, error) {
	pause := firstPause
	var named *Error // the last answer that named an operation
	for attempt := 1; ; attempt++ {
		got, err := call(ctx)
		if err == nil {
			return got, nil
		}
		var done *Error
		if errors.As(err, &done) || errors.Is(err, grpc.ErrClientConnClosing) {
			// Already read (an operation's own failure), or this client was
			// closed (grpc-go's own sentinel): final.
			return got, err
		}
		e := newError(method, status.Convert(err), attempt)
		if e.OperationID() != "" {
			named = e
		}
		wait, again := replayable(ctx, e)
		if !again {
			return got, keepNamed(e, named, attempt)
		}
		if wait == 0 {
			wait = pause/2 + rand.N(pause/2+1)
			pause = min(pause*2, maxPause)
		}
		if deadline, ok := ctx.Deadline(); ok && time.Now().Add(wait+replayFloor).After(deadline) {
			return got, keepNamed(e, named, attempt)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return got, keepNamed(e, named, attempt)
		case <-t.C:
		}
	}
}

// keepNamed is the error to return when last is the last answer: last,
// unless it names no operation and named (an earlier answer) did.
func keepNamed(last, named *Error, attempts int) *Error {
	if named == nil || last.OperationID() != "" {
		return last
	}
	kept := *named
	kept.Attempts = attempts
	kept.Last = last
	return &kept
}

// replayable says whether e is an answer that a replay of the same request
// may change, and the pause the service asked for (0: the client's
// backoff). Decided from the code and the reason only. Never when ctx has
// ended: then the answer stands.
func replayable(ctx context.Context, e *Error) (time.Duration, bool) {
	if ctx.Err() != nil {
		return 0, false
	}
	hint, hinted := e.RetryDelay()
	transport := len(e.Infos) == 0 // the service sends an ErrorInfo with all its own answers
	switch e.Code {
	case codes.DeadlineExceeded:
		// The service's own "not known yet, ask again" (OUTCOME_UNKNOWN;
		// OPERATION_IN_PROGRESS for a replay that joined; WATCH_IDLE for a
		// watch), sent while the caller still has time. Any other
		// DEADLINE_EXCEEDED (BUDGET_TOO_SMALL, the caller's own deadline)
		// stands.
		switch e.Reason {
		case ReasonOutcomeUnknown, ReasonOperationInProgress, ReasonWatchIdle:
			return hint, true
		}
		return 0, false
	case codes.Unavailable:
		// A connection refused, reset or drained (GOAWAY) carries no
		// ErrorInfo; the service's own UNAVAILABLE (Nova unreachable for the
		// whole budget) is a decided answer unless it asks to come back.
		return hint, transport || hinted
	case codes.Aborted, codes.ResourceExhausted:
		// VOLUME_BUSY, a shed call: only with the service's retry hint.
		return hint, hinted
	case codes.Canceled, codes.Internal, codes.Unknown:
		// Not our context (checked above): a connection closed under the
		// call (a server's drain), a stream reset by a GOAWAY race. The
		// service's own INTERNAL carries an ErrorInfo and stands.
		return 0, transport
	}
	return 0, false
}
