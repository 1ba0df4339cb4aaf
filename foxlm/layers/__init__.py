"""foxlm.layers"""
