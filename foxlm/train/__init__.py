"""foxlm.train"""
