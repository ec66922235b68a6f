"""What the worker's sampler emits under a thinking control, without a sampler."""

from expertmesh.chat.thinking import ThinkingControl, ThinkingState


def run(control: ThinkingControl, drawn: list[int]) -> tuple[list[int], ThinkingState]:
    """Emit one token per drawn one, as the sampler does: next_token, then observe what was emitted."""
    state, out = ThinkingState(control), []
    for t in drawn:
        t = state.next_token(t)
        state.observe(t)
        out.append(t)
    return out, state
