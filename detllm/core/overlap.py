"""The served-concurrency rule: did a server compute a group of concurrent requests together?

Owns the one rule both the openai backend (to decide whether to send a group again before calling it
not engaged) and pipeline/engagement.py (the verdict, and verify's re-derivation) apply to the
evidence each request recorded (timing_ms, server_ms, server_batch). Pure: reads dicts only.
"""

from __future__ import annotations

from typing import Any, Sequence

ENGAGED, NOT_ENGAGED, NOT_OBSERVABLE = "engaged", "not_engaged", "not_observable"


def served_group(evs: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(answer, why) for one group of concurrent requests, from each request's evidence: engaged when the
    client's intervals overlapped and the server computed more than one at once (several busy slots
    sampled, or its own per-request times adding up past the group's wall time: disjoint ones cannot);
    not engaged when it reports fewer slots than requests in flight, or its times add up to no more
    than the wall time (evidence that covers the whole group); else not observable (a point sample of
    0 or 1 busy proves nothing)."""
    spans = [tuple(ev.get("timing_ms") or ()) for ev in evs]
    if len(evs) < 2 or any(len(s) != 2 for s in spans):
        return NOT_OBSERVABLE, "the client's request intervals were not recorded"
    batch = evs[0].get("server_batch") or {}
    server_ms = [ev.get("server_ms") for ev in evs]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    overlapped = max(s for s, _ in spans) < min(e for _, e in spans)
    busy, slots = batch.get("server_busy_max"), batch.get("server_slots")
    total = sum(server_ms) if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in server_ms) else None
    told = (f"{len(evs)} requests, client intervals {'overlapped' if overlapped else 'did not all overlap'}, wall {wall:.1f} ms"
            + (f", server times summing to {total:.1f} ms" if total is not None else "")
            + (f", at most {busy} busy in {batch.get('samples', 0)} {batch.get('source')} samples" if busy is not None else ""))
    if isinstance(slots, int) and not isinstance(slots, bool) and slots < len(evs):
        return NOT_ENGAGED, f"{told}; the server reports {slots} slot(s)"
    if total is not None and total <= wall:
        return NOT_ENGAGED, f"{told}: the server computed them one after another"
    if overlapped and ((busy or 0) >= 2 or (total is not None and total > wall)):
        return ENGAGED, told
    return NOT_OBSERVABLE, told


__all__ = ["ENGAGED", "NOT_ENGAGED", "NOT_OBSERVABLE", "served_group"]
