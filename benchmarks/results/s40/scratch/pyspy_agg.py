import collections,re,sys
inc=collections.Counter(); selfc=collections.Counter(); tot=0
IDLE=('select (selectors','wait (threading','_wait_for_tstate_lock','poll (','epoll','get (queue','sleep','_worker (concurrent')
for line in open(sys.argv[1]):
    stack,_,n=line.rstrip().rpartition(' '); n=int(n)
    frames=stack.split(';')
    if any(k in frames[-1] for k in IDLE): continue
    tot+=n
    seen=set()
    for f in frames:
        f=re.sub(r'\(/\S*site-packages/', '(', f)
        if f not in seen: inc[f]+=n; seen.add(f)
    selfc[re.sub(r'\(/\S*site-packages/', '(', frames[-1])]+=n
print('busy samples',tot)
for f,n in inc.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 60): print(f"{n:6d} {100*n/tot:5.1f}% {f[:160]}")
print('--- self')
for f,n in selfc.most_common(30): print(f"{n:6d} {100*n/tot:5.1f}% {f[:160]}")
