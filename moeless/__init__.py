"""moeless: serverless experts for Mixture-of-Experts LLM serving."""
__version__ = "0.1.0"
