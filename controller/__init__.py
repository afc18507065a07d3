"""moeless.controller"""
