"""Front ends: the `dlm-jax` command line (`cli`), the lm-evaluation-harness model (`lmeval`),
one-line error reporting and Ctrl-C handling (`_report`). `dlm_jax.load` (`dlm_jax.api`) is the
Python API they share."""
