"""foxlm.data"""
