"""expertmesh: deploy and serve a 2.8T MXFP4 MoE model on Kubernetes."""

__version__ = "0.1.0"
