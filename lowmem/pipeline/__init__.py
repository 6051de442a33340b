"""The DVC pipeline's own commands (top layer): every stage's parameters resolved, the training stages, the run
index, the stage timer and the atomic writes of the notebook stages' outputs."""
