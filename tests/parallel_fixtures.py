"""What the split-render tests run inside the spawned workers (imported there by name, so it lives in a module).

`inject_faults` is a `WorkerSpec.setup`: after a worker has loaded, it arms block 0 of each DiT to raise on the
second forward of a render whose prompt asks for it. Everything else in the worker is the real code.
"""

from __future__ import annotations

FAULT_ONE = "fault on rank {rank}"  # a render with this prompt fails on that rank alone
FAULT_ALL = "fault on every rank"  # and with this one on every rank, at the same point


def inject_faults(engine, rank: int) -> None:
    state = {"armed": False, "calls": 0}
    render = engine.render

    def faulty_render(request, ctx=None, on_step=None):
        state["armed"] = request.prompt in (FAULT_ONE.format(rank=rank), FAULT_ALL)
        state["calls"] = 0
        return render(request, ctx, on_step)

    def hook(module, args):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == 2:  # the second forward: the first went through every collective
                raise RuntimeError(f"injected fault on rank {rank}")

    engine.render = faulty_render
    for dit in engine.components.dits.values():
        dit.blocks[0].register_forward_pre_hook(hook)
