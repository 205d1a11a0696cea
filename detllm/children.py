"""(being moved here: issue 19)"""
