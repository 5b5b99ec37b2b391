"""update"""
