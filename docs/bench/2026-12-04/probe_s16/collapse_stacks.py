import sys, collections, re
def load(p):
    rows=[]
    for line in open(p):
        line=line.rstrip()
        if not line: continue
        stack,_,n=line.rpartition(' ')
        rows.append((stack.split(';'),int(n)))
    return rows
def short(f):
    # "func (path/file.py:line)" -> "file.py:func"
    m=re.match(r'(.*) \((.*?):?(\d+)?\)$',f)
    if not m: return f
    fn,path=m.group(1),m.group(2)
    parts=path.split('/')
    if 'site-packages' in parts:
        i=parts.index('site-packages'); mod='/'.join(parts[i+1:i+3])
    elif 'python3.11' in parts:
        mod='stdlib/'+parts[-1]
    else:
        mod='/'.join(parts[-2:])
    return f"{mod}:{fn}"
def main():
    paths=sys.argv[1:]
    tot=0; incl=collections.Counter(); self_=collections.Counter(); mods=collections.Counter()
    for p in paths:
        for st,n in load(p):
            tot+=n
            fs=[short(f) for f in st]
            for f in set(fs): incl[f]+=n
            self_[fs[-1]]+=n
            # module of leaf
            mods[fs[-1].split(':')[0]]+=n
    print("total samples",tot)
    print("-- inclusive top 45")
    for f,n in incl.most_common(45): print(f"{100*n/tot:5.1f}% {f}")
    print("-- self top 30")
    for f,n in self_.most_common(30): print(f"{100*n/tot:5.1f}% {f}")
    print("-- leaf module top 20")
    for f,n in mods.most_common(20): print(f"{100*n/tot:5.1f}% {f}")
main()
