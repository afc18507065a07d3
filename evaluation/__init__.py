"""moeless.evaluation: `moeless eval` and `moeless report`: the paper's evaluation and the deployment
planner, thin drivers over the twin, and their reports (markdown, JSON, CSV, PNG).

Real prompts and real arrival traces become serving iterations; the model's real routing and the
gate-replica predictor's forecasts feed every planner; the digital twin (twin/twin.py) prices
the plans with a measured cost profile under both execution and both billing models. A run
directory holds everything measured (run.json); the report is a pure function of it.
"""
