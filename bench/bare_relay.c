/* bare_relay: the machine's floor for one relay hop (bench/_relay.py builds and starts it).

   usage: bare_relay LISTEN_PORT TARGET_PORT   (both on 127.0.0.1)

   Accepts connections on 127.0.0.1:LISTEN_PORT; for each, connects to
   127.0.0.1:TARGET_PORT and copies bytes both ways on one thread per
   connection (poll on both sockets, blocking send of what each receive
   brought), with TCP_NODELAY on both, a half-close passed on as
   shutdown(SHUT_WR), and nothing else: no parsing, no checks, no counters.
   What it costs over a direct connection is what any relay that wakes up once
   per message on each side costs on this machine; the benches print the
   front door's and the TLS tunnel's figures against it.  Prints "listening"
   on stdout when ready. */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

static int target_port;

static int send_all(int fd, const char *p, ssize_t n) {
    while (n > 0) {
        ssize_t k = send(fd, p, (size_t)n, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        p += k;
        n -= k;
    }
    return 0;
}

static void *serve(void *arg) {
    int c = (int)(long)arg, one = 1;
    int u = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((unsigned short)target_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    char (*bufs)[1 << 20] = malloc(2 * sizeof *bufs);  /* one receive buffer per direction */
    if (bufs == NULL || u < 0 || connect(u, (struct sockaddr *)&to, sizeof to) != 0) goto out;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(u, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct pollfd fds[2] = {{.fd = c, .events = POLLIN}, {.fd = u, .events = POLLIN}};
    int open_dirs = 2;
    while (open_dirs > 0) {
        if (poll(fds, 2, -1) < 0) break;
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int other = i == 0 ? u : c;
            ssize_t n = recv(fds[i].fd, bufs[i], sizeof bufs[i], 0);
            if (n <= 0) {  /* EOF or reset: pass the half-close on, stop reading this side */
                shutdown(other, SHUT_WR);
                fds[i].fd = -1;
                open_dirs--;
                if (n < 0) open_dirs = 0;
            } else if (send_all(other, bufs[i], n) != 0) {
                open_dirs = 0;
            }
        }
    }
out:
    free(bufs);
    close(c);
    if (u >= 0) close(u);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LISTEN_PORT TARGET_PORT\n", argv[0]);
        return 2;
    }
    target_port = atoi(argv[2]);
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[1])),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&at, sizeof at) != 0 || listen(l, 16) != 0) {
        perror("bare_relay: listen");
        return 1;
    }
    printf("listening\n");
    fflush(stdout);
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) continue;
        pthread_t t;
        if (pthread_create(&t, NULL, serve, (void *)(long)c) == 0) pthread_detach(t);
        else close(c);
    }
}
