"""Training: the loop (`loop`), FSDP and its units (`fsdp`), prefetching the next window
(`prefetch`), early stopping, injected faults for tests (`faults`), and the context a worker runs
in, with Ray (`ray_context`) or without it (`context`). The objectives it calls are
`jobs.objectives`."""
