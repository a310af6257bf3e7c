package volumereconciler

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Pauses between replays of a key: from 20 ms, doubling, at most 1 s, each
// drawn at random between half and all of it so that callers cut off
// together (a replica draining) do not come back together. There is no
// count limit and no time limit of the client's own: the caller's context
// ends the replays, and a pause that would end past its deadline is not
// taken (the last answer is returned instead).
const (
	firstPause = 20 * time.Millisecond
	maxPause   = time.Second
)

// replay sends call until it answers an operation, an error that a replay
// cannot change, or ctx ends; always with the same request, so the same
// idempotency key.
func replay[T any](ctx context.Context, method string, call func(context.Context) (T, error)) (T, error) {
	pause := firstPause
	for attempt := 1; ; attempt++ {
		got, err := call(ctx)
		if err == nil {
			return got, nil
		}
		var done *Error
		if errors.As(err, &done) {
			// Already read (an operation's own failure): final.
			return got, err
		}
		st := status.Convert(err)
		e := newError(method, st, attempt)
		wait, again := replayable(ctx, e)
		if !again {
			return got, e
		}
		if wait == 0 {
			wait = pause/2 + rand.N(pause/2+1)
			pause = min(pause*2, maxPause)
		}
		if deadline, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(deadline) {
			return got, e
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return got, e
		case <-t.C:
		}
	}
}

// replayable says whether e is an answer that a replay of the same key may
// change, and the pause the service asked for (0: the client's backoff).
// Never when ctx has ended: then the answer stands.
func replayable(ctx context.Context, e *Error) (time.Duration, bool) {
	if ctx.Err() != nil {
		return 0, false
	}
	hint, hinted := e.RetryDelay()
	switch e.Code {
	case codes.DeadlineExceeded:
		// The service's own "not known yet, ask again with the same key"
		// (OUTCOME_UNKNOWN; OPERATION_IN_PROGRESS for a replay that joined;
		// WATCH_IDLE for a watch), sent while the caller still has time.
		// Any other DEADLINE_EXCEEDED (BUDGET_TOO_SMALL, the caller's own
		// deadline) stands.
		switch e.Reason {
		case "OUTCOME_UNKNOWN", "OPERATION_IN_PROGRESS", "WATCH_IDLE":
			return hint, true
		}
		return 0, false
	case codes.Unavailable:
		// A connection refused, reset or drained (GOAWAY) carries no
		// ErrorInfo; the service's own UNAVAILABLE (Nova unreachable for the
		// whole budget) is a decided answer unless it asks to come back.
		return hint, len(e.Infos) == 0 || hinted
	case codes.Aborted, codes.ResourceExhausted:
		// VOLUME_BUSY, a shed call: only with the service's retry hint.
		return hint, hinted
	case codes.Canceled:
		// Not our context (checked above): a connection closed under the
		// call, as a server's drain does.
		return 0, len(e.Infos) == 0
	case codes.Internal, codes.Unknown:
		// A stream reset by a GOAWAY race or a dropped connection surfaces
		// as a transport-level error without ErrorInfo.
		m := strings.ToLower(e.Message)
		return 0, len(e.Infos) == 0 && (strings.Contains(m, "rst_stream") ||
			strings.Contains(m, "goaway") || strings.Contains(m, "transport") ||
			strings.Contains(m, "connection"))
	}
	return 0, false
}
