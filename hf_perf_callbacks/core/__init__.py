"""Pure cores: numbers in, numbers out (statistics, step accounting, splits, the memory policy, FLOPs, peaks), the two
files a run writes (records, their readers), the words shared by the callbacks and the report. No torch, no
transformers."""
