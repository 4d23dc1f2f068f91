"""Plain, importable code that the Triton Python-backend models in ``model_repository/`` run.

Nothing here imports ``triton_python_backend_utils``: every module can be unit-tested without a server.
"""
