"""A stand-in for a step's compiler that records what is queued and asked for, so that the choices
of the prefetcher, the fallback and the compile policies are tested without compiling anything."""

from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program


class ProgramRecord:
  """What one program was asked for: ``queued``, the shapes of each prefetch; ``first``, those
  queued ahead of the others; ``got``, the shapes asked for; ``prefetches`` and ``gets``, the
  calls that named it."""

  def __init__(self):
    self.queued, self.first, self.got = [], [], []
    self.prefetches = self.gets = 0


class RecordingCompiler:
  """Stands in for StepProgramCompiler: ``calls`` are the ``(programs, first)`` prefetched, in
  order; ``fused``, ``micro`` and ``update`` what each program was asked for; ``compiled`` is its
  view; ``threads``, the compiles of each kind of program that run at once."""

  def __init__(self, compiled=None, threads=2):
    self.compiled, self.threads = compiled, threads
    self.calls = []
    self.fused, self.micro, self.update = ProgramRecord(), ProgramRecord(), ProgramRecord()

  def prefetch(self, programs, *, first=False):
    programs = list(programs)
    self.calls.append((programs, first))
    for program, record in ((Program.FUSED, self.fused), (Program.MICRO, self.micro)):
      shapes = [micro for kind, micro in programs if kind == program]
      if shapes:
        (record.first if first else record.queued).append(shapes)
    self.update.prefetches += APPLY in programs

  def get(self, key):
    program, micro = key
    record = {Program.FUSED: self.fused, Program.MICRO: self.micro, Program.APPLY: self.update}
    record[Program(program)].got.append(micro)
    record[Program(program)].gets += 1

  def view(self):
    return self.compiled
