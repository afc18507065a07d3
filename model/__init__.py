"""moeless.model"""
