"""One render over several GPUs of a host: Ulysses sequence parallelism over torch.distributed.

group    the process group of the ranks and the few collectives a render uses (`Group`)
ranks    one rank's part of a render: its rows of the packed sequence, the all-to-alls around attention, the
         gathered outputs, the dealt-out decode windows, the agreed cancel (`Ranks`, a `pipeline.spread.Spread`)
workers  the processes: one spawned worker per GPU, and `ParallelEngine`, the engine the CLI and the service use
         in the parent (`load_engine` picks it for H3_NUM_GPUS > 1 or H3_NNODES > 1)
nodes    several hosts as one group: node 0's authenticated rendezvous (`Rendezvous`), a joining node's side
         (`join_node`), the lost node (docs/two-sparks.md)
"""
