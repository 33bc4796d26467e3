"""What a running job reports, and how it stops: one layer above the parallel groups.

    failure.py        error lines from whichever rank finds them; agreed (collective) checks;
                      the one line per survivor naming a lost rank
    peers.py          the roll call over the launcher's store: which rank is gone
    watchdog.py       the hang watchdog thread: a diagnosis, then an abort
    metrics.py        the metrics file (--metrics-file)
    logging_utils.py  Megatron's log lines, timers, TensorBoard and W&B writers
"""
