"""The planner: a model of megaq's own training step on any cluster, before launch.

    hardware.py     GPU presets and a Cluster (nodes, links)
    calibration.py  the efficiency tables, fitted on the reference GPU (calibration_h200.json)
    shapes.py       the parameters of each ZeRO unit on one GPU
    compute.py      FLOPs (megaq.model.flops) and element-wise bytes -> seconds
    traffic.py      each collective's bytes (megaq.zero.zeropp.volume) -> seconds
    memory.py       bytes per GPU by part
    bubble.py       the pipeline schedules' idle slots
    step.py         PlanInput -> predict() -> Prediction
    search.py       layouts and switches ranked by predicted throughput
    report.py       the plan as a table

Importing the package loads nothing heavy; import the module you need
(``from megaq.planner.step import predict``).
"""
