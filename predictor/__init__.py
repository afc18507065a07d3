"""moeless.predictor"""
