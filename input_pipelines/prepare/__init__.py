"""The record writers' engine: tasks on Dask distributed (`engine.py`)."""
