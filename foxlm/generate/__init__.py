"""foxlm.generate"""
