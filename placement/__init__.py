"""moeless.placement"""
