# scratch: kernel variants for the K = 64 output_states hunt
import sys, re
path, variant = sys.argv[1], sys.argv[2]
s = open(path).read()
if variant == "own":
    s = s.replace("self.states or (self.output_states and R != C)", "self.states or self.output_states")
elif variant == "nostore":
    s = s.replace("self.store_chunk_state(", "self.no_store(")
    s = s.replace("    def chunk_state_rows(", "    def no_store(self, *args):\n        pass\n\n    def chunk_state_rows(")
elif variant == "nos2g":
    s = s.replace("        _mma.copy_tile_s2g(s2g, tidx, staging, self.chunk_state_rows(chunk_states, chunk, head, row_block))",
                  "        pass")
elif variant == "elem":
    s = s.replace("        _mma.stage_accumulator_stmatrix(state_mma, tidx, state, staging)\n        cute.arch.sync_threads()",
                  "        coords = state_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.rows, self.key_dim)))\n"
                  "        _mma.stage_accumulator(state, coords, staging)\n        cute.arch.sync_threads()")
assert s != open(path).read(), variant
open(path, "w").write(s)
