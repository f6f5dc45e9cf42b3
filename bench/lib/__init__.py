"""What bench/ scripts share, through the engine's own seams (`h3serve.accel.apply` for every measured variant):

    models    the released-size components with random weights, the tiny DiT, the released configurations
    shapes    the packed shapes measured and their inputs (`inputs`, `text_states`, `forward`)
    variants  the measured variants as data (a `Profile`, `Compiler` options, `Passes`) and the comparison-only pieces
              production does not carry (naive FP8 attention scales, FP8 GEMMs without fast accumulation)
    timing    the run's header, CUDA-event timing, peak memory, a timed render
    profiler  torch.profiler tables: top kernels, the per-category breakdown, a split forward's collectives
    split     a DiT forward split over spawned ranks (`Job`, `run_group`, `StandIn`) and its scaling table
    peer      diffusers' model (the peer) over our weights
    host      the host's side: page-cache eviction, resident memory, GPU memory as nvidia-smi sees it

A script run as `python bench/x.py` has bench/ as sys.path[0], so `import lib` needs nothing more; h3serve comes from
the environment (`PYTHONPATH=src` in a checkout).
"""
