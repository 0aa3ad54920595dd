"""Speculative decoding without a draft model: drafting (proposers), the load gate and the
scheduler's handle on both (speculator); verification runs in worker/model_runner.py."""
