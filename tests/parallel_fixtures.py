"""What the split-render tests run inside the spawned workers (imported there by name, so it lives in a module).

`faulty_engine` is an `engine_factory` of `ParallelEngine`: each rank's engine loaded as in production, then
`inject_faults` arms block 0 of each DiT to raise on the second forward of a render whose prompt asks for it.
Everything else in the worker is the real code.
"""

from __future__ import annotations

from h3serve.parallel.messages import Mailbox, Stop
from h3serve.parallel.workers import RankPlace, WorkerSpec, load_rank_engine

FAULT_ONE = "fault on rank {rank}"  # a render with this prompt fails on that rank alone
FAULT_ALL = "fault on every rank"  # and with this one on every rank, at the same point
FAULT_TEXT = "fault in the text stage"  # in rank 0's text encoder, a stage only rank 0 runs


def faulty_engine(spec: WorkerSpec, place: RankPlace):
    engine = load_rank_engine(spec, place)
    inject_faults(engine, place.rank)
    return engine


def tile_batching_engine(spec: WorkerSpec, place: RankPlace):
    """Each rank decodes its own tiles of a window 2 at a time (`VideoVAE.tile_batch`; the CPU profile runs 1)."""
    from h3serve.accel.vae import set_tile_batch

    engine = load_rank_engine(spec, place)
    set_tile_batch(engine.components.video_vae, 2)
    return engine


def echo(inbox: Mailbox, outbox: Mailbox) -> None:
    """A process that sends back each message it receives, as it decoded it, until a Stop (sent back too)."""
    while True:
        message = inbox.get()
        outbox.put(message)
        if isinstance(message, Stop):
            return


def inject_faults(engine, rank: int) -> None:
    state = {"armed": False, "calls": 0}
    render = engine.render

    def faulty_render(request, ctx=None, on_step=None):
        state["armed"] = request.prompt in (FAULT_ONE.format(rank=rank), FAULT_ALL)
        state["text"] = request.prompt == FAULT_TEXT
        state["calls"] = 0
        return render(request, ctx, on_step)

    def text_hook(module, args, kwargs):
        if state["text"]:
            raise RuntimeError(f"injected text-encoder fault on rank {rank}")

    def hook(module, args):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == 2:  # the second forward: the first went through every collective
                raise RuntimeError(f"injected fault on rank {rank}")

    engine.render = faulty_render
    if rank == 0:
        engine.components.text_encoder.model.register_forward_pre_hook(text_hook, with_kwargs=True)
    for dit in engine.components.dits.values():
        dit.blocks[0].register_forward_pre_hook(hook)
