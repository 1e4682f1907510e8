"""gradaccum: the library of the gradient accumulation study.

The training loop (loop.py) with exact accumulation (accumulation.py), the models (models.py),
data parallelism (distributed.py), memory capture (memory.py), the planner and its sweep
(planner.py, sweep.py), the gradient check, the data (mnist.py), validated params (params.py),
one variant's run (experiment.py) and the report (report/). It knows no pipeline paths: the
scripts in stages/ read and write the files that dvc.yaml declares.
"""
