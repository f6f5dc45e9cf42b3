"""Acceleration applied from outside the model files. `profile` holds the choices as one value; `apply` is the only
place a profile becomes transforms of loaded models (and load hooks for the loader); each backend module is a
registry that refuses what it cannot run. Nothing here keeps process state: every choice lives on the model it
concerns."""
