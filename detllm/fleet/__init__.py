"""The fleet: N endpoints or N run folders in one verdict. Groups identical traces per prompt, names
the majority and the outlier replicas, and names an identity mismatch first (docs/fleet.md). N sides
go through the same `compare` engine as a pairwise diff; N endpoints are N `openai` backends made
through the registry.
"""
