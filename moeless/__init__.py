"""moeless: serverless experts for Mixture-of-Experts LLM serving.

The `moeless` command (cli.py) over the packages; the layers: README.md, Architecture.
"""
__version__ = "0.1.0"
