#!/usr/bin/env python3
"""Compare the layouts of normcore's lambda closures between two compilers.

usage: closure_layouts.py GCC_OBJECT_DIR CLANG_OBJECT_DIR

Each directory holds objects built with debug information (-g) from the same
sources by one compiler. For every closure type declared in a normcore header
the script reads, from llvm-dwarfdump's output, its captured members in
offset order; a lambda (file:line) has one such list per instantiation. The
two compilers must give every lambda the same set of lists: a program linked
from both compilers' objects keeps one copy of each inline function, so one
compiler's call operator may read a closure that the other's inlined code
built (see "Lambdas" in include/normcore/config.hpp). Member names are
compared without the leading "__" that GCC adds. Exits 1 on any difference,
or when no closure was found (a parse that found nothing checks nothing).

Limitation: the lists are compared as a set per lambda, not instantiation by
instantiation (Clang's debug information does not tie every closure type to
the function that encloses it), so two instantiations whose layouts the two
compilers swapped would pass. tests/robustness/mixed_compilers.cpp, which
runs the program, is the check of the calls themselves.
"""
import collections
import pathlib
import re
import shutil
import subprocess
import sys

DIE = re.compile(r'^0x[0-9a-f]+:(\s+)(DW_TAG_\w+)')
ATTR = re.compile(r'^\s+(DW_AT_\w+)\s+\((.*)\)$')


def dwarfdump():
    for name in ('llvm-dwarfdump', 'llvm-dwarfdump-14'):
        path = shutil.which(name)
        if path:
            return path
    sys.exit('closure_layouts: llvm-dwarfdump not found (Debian package llvm-14)')


def closures(tool, obj):
    """{'normcore/x.hpp:line': {'a,b,this', ...}} for one object."""
    proc = subprocess.Popen([tool, '--debug-info', str(obj)], stdout=subprocess.PIPE, text=True)
    found = collections.defaultdict(set)
    types = []  # the open class/structure DIEs: [depth, attributes, members, the members' depth]

    def finish(t):
        at, members = t[1], t[2]
        name = at.get('DW_AT_name', '')
        where = at.get('DW_AT_decl_file', '').strip('"')
        if '/normcore/' not in where or (name and 'lambda' not in name) or at.get('DW_AT_declaration') == 'true':
            return  # not a closure of a normcore header (closures have no name, or "<lambda...>")
        if not members:
            return
        members.sort()
        names = [n[2:] if n.startswith('__') else n for _, n in members]
        key = 'normcore/' + where.split('/normcore/', 1)[1] + ':' + at.get('DW_AT_decl_line', '?')
        found[key].add(','.join(names))

    target = None  # where the current DIE's attributes go: a type's dict, a member's record, or nowhere
    for line in proc.stdout:
        m = DIE.match(line)
        if m:
            depth, tag = len(m.group(1)), m.group(2)
            while types and types[-1][0] >= depth:
                finish(types.pop())
            target = None
            if types:
                t = types[-1]
                if t[3] is None:
                    t[3] = depth  # a type's direct children all sit at this depth
                if depth == t[3] and tag == 'DW_TAG_member':
                    t[2].append([0, '?'])
                    target = t[2][-1]
            if tag in ('DW_TAG_class_type', 'DW_TAG_structure_type'):
                types.append([depth, {}, [], None])
                target = types[-1][1]
            continue
        a = ATTR.match(line)
        if not a or target is None:
            continue
        if isinstance(target, dict):
            target.setdefault(a.group(1), a.group(2))
        elif a.group(1) == 'DW_AT_data_member_location':
            target[0] = int(a.group(2), 0)
        elif a.group(1) == 'DW_AT_name':
            target[1] = a.group(2).strip('"')
    while types:
        finish(types.pop())
    if proc.wait() != 0:
        sys.exit(f'closure_layouts: llvm-dwarfdump failed on {obj}')
    return found


def collect(tool, directory):
    objs = sorted(pathlib.Path(directory).glob('*.o'))
    if not objs:
        sys.exit(f'closure_layouts: no objects in {directory}')
    total = collections.defaultdict(set)
    for obj in objs:
        for key, layouts in closures(tool, obj).items():
            total[key] |= layouts
    return total


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    tool = dwarfdump()
    gcc, clang = collect(tool, sys.argv[1]), collect(tool, sys.argv[2])
    keys = sorted(set(gcc) | set(clang))
    bad = [k for k in keys if gcc.get(k) != clang.get(k)]
    for k in bad:
        print(f'{k}: captures differ')
        print('  GCC:   ' + ' | '.join(sorted(gcc.get(k, ()))))
        print('  Clang: ' + ' | '.join(sorted(clang.get(k, ()))))
    print(f'closure_layouts: {len(keys)} lambdas with captures, {len(bad)} laid out differently')
    if not keys or bad:
        sys.exit(1)


if __name__ == '__main__':
    main()
