"""foxlm.eval"""
