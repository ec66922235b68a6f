"""A performance model of a deployment at cluster scale, torch-free: the GPU table (`gpus.py`), the models it
knows (`models.py`), the roofline terms of one step with their measured efficiencies (`terms.py`), the prediction
of a layout and workload (`predict.py`) and the smallest layout that meets an SLO (`slo.py`)."""
