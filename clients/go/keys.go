package volumereconciler

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// KeyFor makes an idempotency key from the parts that name one intent, for
// callers that have no natural key (CSI's ControllerPublishVolume carries
// none): the same parts always give the same key, so a retried intent is a
// replay; different parts (or the same parts cut differently) give
// different keys.
//
// The recipe, to reproduce in another language: SHA-256 over each part as
// its length in bytes (decimal ASCII), a colon, then the part's bytes, one
// after another; the key is "vr1-" followed by the digest's first 16 bytes
// in lowercase hex (36 characters, within the service's 255). The Rust
// client takes the caller's key as it is and has no recipe of its own.
//
// For a CSI controller: KeyFor("publish", volumeHandle, nodeID,
// generation), where generation is what makes a publish after an
// unpublish a new intent (the VolumeAttachment's UID, or a counter the
// controller bumps when an unpublish completes); without it the second
// publish would be a replay of the first and answer its old operation.
func KeyFor(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(strconv.Itoa(len(p))))
		h.Write([]byte{':'})
		h.Write([]byte(p))
	}
	return "vr1-" + hex.EncodeToString(h.Sum(nil)[:16])
}
