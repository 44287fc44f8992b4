/* kv_fs.c: see kv_fs.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif

static int64_t mtime_ns(const struct stat *st)
{
#if defined(__APPLE__)
    return (int64_t)st->st_mtimespec.tv_sec * 1000000000 + st->st_mtimespec.tv_nsec;
#else
    return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
#endif
}

static int ends_with(const char *s, size_t n, const char *suffix, size_t k)
{
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

/* Append "sub/name" and an item; ENOMEM when memory runs out. */
static int add(kv_fs_scan *out, const char *sub, size_t sub_len, const char *name,
               size_t name_len, const struct stat *st, int kind)
{
    size_t need = sub_len + 1 + name_len + 1;
    if (out->names_len + need > out->names_cap) {
        size_t cap = out->names_cap ? out->names_cap : 4096;
        while (cap < out->names_len + need)
            cap *= 2;
        char *p = realloc(out->names, cap);
        if (!p)
            return ENOMEM;
        out->names = p;
        out->names_cap = cap;
    }
    if (out->n == out->cap) {
        size_t cap = out->cap ? out->cap * 2 : 256;
        kv_fs_item *p = realloc(out->items, cap * sizeof *p);
        if (!p)
            return ENOMEM;
        out->items = p;
        out->cap = cap;
    }
    kv_fs_item *it = &out->items[out->n++];
    it->name = out->names_len;
    it->size = (int64_t)st->st_size;
    it->mtime_ns = mtime_ns(st);
    it->kind = kind;
    char *dst = out->names + out->names_len;
    memcpy(dst, sub, sub_len);
    dst[sub_len] = '/';
    memcpy(dst + sub_len + 1, name, name_len);
    dst[sub_len + 1 + name_len] = '\0';
    out->names_len += need;
    return 0;
}

/* The next entry of `dir` other than "." and "..", or NULL at its end (a
 * read error ends it too: what is not listed is passed over). */
static struct dirent *next_entry(DIR *dir)
{
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        const char *n = e->d_name;
        if (!(n[0] == '.' && (n[1] == '\0' || (n[1] == '.' && n[2] == '\0'))))
            break;
    }
    return e;
}

/* The files of one subdirectory (open as `fd`, which this closes). */
static int list_sub(int fd, const char *sub, const char *suffix, const char *tmp_prefix,
                    int64_t cutoff, int want_stale, int want_bad, kv_fs_scan *out)
{
    DIR *dir = fdopendir(fd);
    if (!dir) {
        close(fd);
        return 0;   /* not listable: nothing of ours */
    }
    size_t sub_len = strlen(sub), k = strlen(suffix), t = strlen(tmp_prefix);
    int rc = 0;
    struct dirent *e;
    while ((e = next_entry(dir)) != NULL) {
        const char *name = e->d_name;
        size_t n = strlen(name);
        int entry = ends_with(name, n, suffix, k);
        int tmp = !entry && want_stale && n >= t && memcmp(name, tmp_prefix, t) == 0;
        if (!entry && !tmp)
            continue;
        struct stat st;
        if (fstatat(dirfd(dir), name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            continue;   /* gone since: passed over */
        int kind;
        if (entry) {
            if (S_ISREG(st.st_mode))
                kind = KV_FS_ENTRY;
            else if (want_bad && !S_ISDIR(st.st_mode))
                kind = KV_FS_BAD;
            else
                continue;
        } else {
            if (mtime_ns(&st) >= cutoff)
                continue;
            kind = KV_FS_STALE;
        }
        rc = add(out, sub, sub_len, name, n, &st, kind);
        if (rc)
            break;
    }
    closedir(dir);
    return rc;
}

int kv_fs_list(const char *root, const char *suffix, const char *tmp_prefix,
               int64_t stale_cutoff_ns, int want_stale, int want_bad, kv_fs_scan *out)
{
    memset(out, 0, sizeof *out);
    int rfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rfd < 0)
        return errno == ENOENT ? 0 : errno;
    DIR *dir = fdopendir(rfd);
    if (!dir) {
        int err = errno;
        close(rfd);
        return err;
    }
    int rc = 0;
    struct dirent *e;
    while ((e = next_entry(dir)) != NULL) {
        const char *name = e->d_name;
#ifdef DT_DIR
        if (e->d_type != DT_DIR && e->d_type != DT_UNKNOWN)
            continue;   /* a file, or a link (never followed) */
#endif
        /* a directory, never through a link (O_NOFOLLOW), never blocking */
        int fd = openat(dirfd(dir), name,
                        O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;
        rc = list_sub(fd, name, suffix, tmp_prefix, stale_cutoff_ns, want_stale, want_bad, out);
        if (rc)
            break;
    }
    closedir(dir);
    return rc;
}

void kv_fs_scan_free(kv_fs_scan *scan)
{
    free(scan->items);
    free(scan->names);
    memset(scan, 0, sizeof *scan);
}

/* Write all of `len` bytes to `fd` (EINTR and short writes retried). */
static int write_all(int fd, const char *p, size_t len)
{
    while (len) {
        ssize_t got = write(fd, p, len);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        p += got;
        len -= (size_t)got;
    }
    return 0;
}

int kv_fs_write(const char *root, const char *sub, const char *name, const char *tmp,
                const void *data, size_t len, int64_t *grown, int *failed_tmp)
{
    *grown = 0;
    *failed_tmp = 0;
    int rfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rfd < 0)
        return errno == ENOENT ? KV_FS_NO_ROOT : errno;
    if (mkdirat(rfd, sub, 0777) != 0 && errno != EEXIST) {
        int err = errno;
        close(rfd);
        return err;
    }
    /* (EEXIST and not a directory, or a link: the open below says so) */
    int dfd = openat(rfd, sub, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int err = dfd < 0 ? errno : 0;
    close(rfd);
    if (dfd < 0)
        return err == ELOOP || err == ENOTDIR ? KV_FS_NOT_OURS : err;
    int rc = 0;
    int64_t old = 0;
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(st.st_mode)) {
            rc = KV_FS_NOT_OURS;
            goto done;
        }
        old = S_ISREG(st.st_mode) ? (int64_t)st.st_size : 0;
    } else if (errno != ENOENT) {
        rc = errno;
        goto done;
    }
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = openat(dfd, tmp, flags, 0644);
    if (fd < 0 && errno == EEXIST) {
        /* left by a writer of this name (pid, thread, key) that died */
        if (unlinkat(dfd, tmp, 0) != 0) {
            rc = errno;
            *failed_tmp = 1;
            goto done;
        }
        fd = openat(dfd, tmp, flags, 0644);
    }
    if (fd < 0) {
        rc = errno;
        *failed_tmp = 1;
        goto done;
    }
    rc = write_all(fd, data, len);
    if (close(fd) != 0 && !rc && errno != EINTR)
        rc = errno;
    if (rc) {
        *failed_tmp = 1;
    } else if (renameat(dfd, tmp, dfd, name) != 0) {
        rc = errno;
    }
    if (rc)
        unlinkat(dfd, tmp, 0);
    else
        *grown = (int64_t)len - old;
done:
    close(dfd);
    return rc;
}

/* The directory of `path` ("DIR/NAME") opened without following a link
 * (in its last component: a subdirectory swapped for one), `*name` set
 * to NAME: a descriptor, or -1 with `*err` set (KV_FS_NOT_OURS where DIR
 * is a link or not a directory). */
static int open_parent(const char *path, const char **name, int *err)
{
    const char *slash = strrchr(path, '/');
    if (!slash || slash == path || slash[1] == '\0') {
        *err = EINVAL;
        return -1;
    }
    size_t dlen = (size_t)(slash - path);
    char *dir = malloc(dlen + 1);
    if (!dir) {
        *err = ENOMEM;
        return -1;
    }
    memcpy(dir, path, dlen);
    dir[dlen] = '\0';
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int e = errno;
    free(dir);
    if (dfd < 0)
        *err = e == ELOOP || e == ENOTDIR ? KV_FS_NOT_OURS : e;
    *name = slash + 1;
    return dfd;
}

int kv_fs_unlink(const char *path)
{
    const char *name;
    int err;
    int dfd = open_parent(path, &name, &err);
    if (dfd < 0)
        return err == KV_FS_NOT_OURS ? ENOTDIR : err;
    err = unlinkat(dfd, name, 0) == 0 ? 0 : errno;
    close(dfd);
    return err;
}

int kv_fs_is_entry(const char *path)
{
    const char *name;
    int err;
    int dfd = open_parent(path, &name, &err);
    if (dfd < 0)
        return 0;
    struct stat st;
    int ok = fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
    close(dfd);
    return ok;
}

int kv_fs_delete(const char *path, int *regular, int64_t *size)
{
    *regular = 0;
    *size = 0;
    const char *name;
    int err;
    int dfd = open_parent(path, &name, &err);
    if (dfd < 0)
        return err;
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        err = errno;
    } else if (S_ISDIR(st.st_mode)) {
        err = KV_FS_NOT_OURS;
    } else if (unlinkat(dfd, name, 0) != 0) {
        err = errno;
    } else {
        err = 0;
        *regular = S_ISREG(st.st_mode) != 0;
        *size = *regular ? (int64_t)st.st_size : 0;
    }
    close(dfd);
    return err;
}

int kv_fs_open_head(const char *path, void *head, size_t probe, int *fd, int64_t *size,
                    size_t *head_len)
{
    *fd = -1;
    *size = 0;
    *head_len = 0;
    const char *name;
    int err;
    int dfd = open_parent(path, &name, &err);
    if (dfd < 0)
        return err;
    int f = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    err = f < 0 ? errno : 0;
    close(dfd);
    if (f < 0)
        return err == ELOOP || err == EISDIR || err == ENXIO || err == EMLINK ? KV_FS_NOT_OURS
                                                                             : err;
    struct stat st;
    if (fstat(f, &st) != 0) {
        err = errno;
        close(f);
        return err;
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return KV_FS_NOT_OURS;
    }
    size_t want = (uint64_t)st.st_size < probe ? (size_t)st.st_size : probe, done = 0;
    while (done < want) {
        ssize_t got = pread(f, (char *)head + done, want - done, (off_t)done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            close(f);
            return err;
        }
        if (got == 0)
            break;
        done += (size_t)got;
    }
    *fd = f;
    *size = (int64_t)st.st_size;
    *head_len = done;
    return 0;
}

int kv_fs_read_close(int fd, void *buf, size_t len, size_t *got, int touch)
{
    size_t done = 0;
    int rc = 0;
    while (buf && done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, (off_t)done);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            rc = errno;
            break;
        }
        if (n == 0)
            break;
        done += (size_t)n;
    }
    if (touch && !rc)
        (void)futimens(fd, NULL);
    close(fd);
    *got = done;
    return rc;
}
