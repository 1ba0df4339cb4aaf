"""foxlm.models"""
