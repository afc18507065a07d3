"""moeless.serving"""
