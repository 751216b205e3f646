"""The engine: requests in, one step at a time (schedule, run, postprocess), tokens out; its scheduler,
sequence records, speculation, fairness and model runner.
"""
