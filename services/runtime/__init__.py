"""The small actor runtime every service shares: bus, logging, service base, subjects.

Imports no package of rlt but itself (pyproject's contracts: no service).
"""
